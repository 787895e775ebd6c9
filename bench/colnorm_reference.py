"""jax_privacy's column-normalized banded losses, the golden numbers
tests/cocoon_ckpt/test_column_normalized.py checks.

Runs only in a separate environment with jax and jax-privacy (never a dependency of
cocoon-ckpt):

    python -m venv /tmp/jpvenv && /tmp/jpvenv/bin/pip install jax jaxlib jax-privacy numpy
    /tmp/jpvenv/bin/python bench/colnorm_reference.py > tests/cocoon_ckpt/golden/colnorm_jax_privacy.json

For each (n, b) it optimises banded Toeplitz coefficients for the prefix-sum workload
(`toeplitz.optimize_banded_toeplitz`, mean error, coefficients at norm 1) and prints the
summed per-query error ||A C^-1||_F^2 (our `BandMF.loss`) of the Toeplitz C and of the
same coefficients column-normalized for n (`toeplitz.inverse_as_streaming_matrix(coef,
column_normalize_for_n=n)`, which jax_privacy recommends when n is known). For the
smallest n it also runs McKenna's general column-normalized banded optimisation
(`banded.optimize`, n x b free parameters, started from those coefficients), the
strategy the noise recursion would need per-step coefficients for; it is slow on CPU,
hence one n only.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax_privacy  # noqa: E402
import numpy as np  # noqa: E402
from jax_privacy.matrix_factorization import banded, streaming_matrix, toeplitz  # noqa: E402

STEPS = [128, 1500, 2048]
BANDS = [2, 4, 8, 16, 64]
#: n at which the general (non-Toeplitz) column-normalized banded strategy is optimised.
GENERAL_STEPS = [128]
COMMAND = (
    "/tmp/jpvenv/bin/python bench/colnorm_reference.py > "
    "tests/cocoon_ckpt/golden/colnorm_jax_privacy.json"
)


def _summed_error(inverse: streaming_matrix.StreamingMatrix, n: int) -> float:
    rows = (streaming_matrix.prefix_sum() @ inverse).row_norms_squared(n)
    return float(np.sum(np.asarray(rows)))


def main() -> None:
    rows = []
    for n in STEPS:
        for b in BANDS:
            coef = np.asarray(toeplitz.optimize_banded_toeplitz(n, bands=b), dtype=np.float64)
            coef = coef / np.linalg.norm(coef)
            row: dict[str, object] = {
                "n": n,
                "bands": b,
                "coefficients": coef.tolist(),
                "toeplitz_loss": _summed_error(toeplitz.inverse_as_streaming_matrix(coef), n),
                "colnorm_loss": _summed_error(
                    toeplitz.inverse_as_streaming_matrix(coef, column_normalize_for_n=n), n
                ),
            }
            if n in GENERAL_STEPS:
                start = banded.ColumnNormalizedBanded.from_banded_toeplitz(n, coef)
                general = banded.optimize(n, bands=b, C=start)
                row["general_colnorm_loss"] = float(np.sum(banded.per_query_error(general)))
            rows.append(row)
            # One line per setting as it finishes: a long run leaves what it has done.
            print(
                json.dumps({k: v for k, v in row.items() if k != "coefficients"}),
                file=sys.stderr,
                flush=True,
            )
    out = {
        "command": COMMAND + " (venv: pip install jax jaxlib jax-privacy numpy)",
        "jax_privacy": getattr(jax_privacy, "__version__", "unknown"),
        "jax": jax.__version__,
        "loss": "||A C^-1||_F^2 summed over the n queries, C at sensitivity 1 (coefficients "
        "at norm 1; column-normalized: every column at norm 1)",
        "settings": rows,
    }
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
