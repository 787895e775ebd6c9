"""BLT, the buffered linear Toeplitz strategy, in one folder: `strategy` (the matrix C,
its min-sep sensitivity and the one noise step `blt_step`), `noise` (`BLTNoise`, its
streaming noise on the keyed fresh noise), `optimize` (parameters of least min-sep
error) and `accounting` (one Gaussian at the min-sep sensitivity, no amplification).

Import the module you need (`cocoon_ckpt.dp.blt.strategy`, ...): this package imports
none of them, so reading a BLT's accounting does not load torch.
"""

__all__: list[str] = []
