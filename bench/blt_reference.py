"""jax_privacy's optimised BLT losses, the golden numbers tests/cocoon_ckpt/test_blt.py checks.

Runs only in a separate environment with jax and jax-privacy (never a dependency of
cocoon-ckpt):

    python -m venv /tmp/jpvenv && /tmp/jpvenv/bin/pip install jax jaxlib jax-privacy numpy
    /tmp/jpvenv/bin/python bench/blt_reference.py > tests/cocoon_ckpt/golden/blt_jax_privacy.json

For each (n, min_sep) it prints the mean-error loss under min-sep participation
(`LossFn.build_min_sep(n, error="mean", min_sep=...)`, max participations ceil(n /
min_sep)) of jax_privacy's optimised BLT at 1..4 buffers (`optimize_loss`) and of its
adaptive `optimize` (buffers chosen while each adds >= 1%). Our loss is n times this
mean loss (`BLT.minsep_loss`: ||A C^-1||_F^2 times the squared min-sep sensitivity).
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax_privacy  # noqa: E402
import numpy as np  # noqa: E402
from jax_privacy.matrix_factorization import buffered_toeplitz as bt  # noqa: E402

SETTINGS = [(16, 4), (64, 4), (64, 16), (128, 8), (256, 64)]
BUFFERS = [1, 2, 3, 4]
COMMAND = (
    "/tmp/jpvenv/bin/python bench/blt_reference.py > tests/cocoon_ckpt/golden/blt_jax_privacy.json"
)


def main() -> None:
    rows = []
    for n, min_sep in SETTINGS:
        loss_fn = bt.LossFn.build_min_sep(n=n, error="mean", min_sep=min_sep)
        row: dict[str, object] = {"n": n, "min_sep": min_sep, "buffers": {}}
        for nbuf in BUFFERS:
            try:
                blt, loss = bt.optimize_loss(loss_fn=loss_fn, num_buffers=nbuf)
            except RuntimeError as err:  # jax_privacy refuses a failed optimisation
                print(f"n={n} min_sep={min_sep} buffers={nbuf}: {err}", file=sys.stderr)
                continue
            row["buffers"][str(nbuf)] = {  # type: ignore[index]
                "mean_loss": float(loss),
                "buf_decay": np.asarray(blt.buf_decay).tolist(),
                "output_scale": np.asarray(blt.output_scale).tolist(),
            }
        blt = bt.optimize(n=n, min_sep=min_sep, max_participations=None, error="mean")
        row["adaptive"] = {
            "buffers": int(blt.buf_decay.shape[0]),
            "mean_loss": float(loss_fn.loss(blt)),
        }
        rows.append(row)
        # One line per setting as it finishes: a long run leaves what it has done.
        print(json.dumps(row), file=sys.stderr, flush=True)
    out = {
        "command": COMMAND,
        "jax_privacy": getattr(jax_privacy, "__version__", "unknown"),
        "jax": jax.__version__,
        "loss": "mean over n of per-query error, times min-sep sensitivity squared",
        "settings": rows,
    }
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
