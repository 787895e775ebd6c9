"""The DP math: the BandMF mechanism, keyed fresh noise and the correlated-noise
recursion, the history GEMV, the cyclic Poisson sampler and the privacy accountant.
numpy and torch only: no store, no trainer."""
