"""The repository's example jobs (`--job examples.digits.run:build` from the repo root).

A regular package, not a namespace folder: a regular package of the same name anywhere
on sys.path wins over a namespace folder whatever the path order, and Opacus installs
a top-level `examples` package into site-packages.
"""
