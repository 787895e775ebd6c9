"""The audit of a store's noise state: what `cocoon-ckpt audit` prints and exits on.

The audit trusts nothing it reads and executes nothing it reads (I7): every manifest of
the chain is parsed and every array checksummed (a CSC its job read in windows, or a
large one, one chunk at a time and walked in windows: `tools.csc_reads`), the stored
ring slots are compared with noise regenerated from the key (so a slot rewritten with a
valid checksum is still caught), epsilon is recomputed from the configuration (not from
the accountant record), "finished" is derived from the step count, and the fingerprint
and key id of every version are recomputed and compared. Every step label, shape and
count is checked against the config before any work or allocation depends on it
(`cocoon_ckpt.tools.bounds`).
Checks that need the job's data (an embedding table's access schedule) run only with a
job the caller names (`job=`, `--job`, `--example`); the report lists what was skipped.

One module per concern: `report` (findings and their text), `chain` (the manifest
chain), `arrays` (bounds and checksums), `records` (records against the config),
`noise` and `embedding` (regenerated noise against the stored history), `permissions`
(who can read the store), `privacy` (what the report says about the guarantee), and
`run` (`audit_store`, the order of the checks).
"""

from __future__ import annotations

from cocoon_ckpt.tools.audit.report import AuditReport, Finding
from cocoon_ckpt.tools.audit.run import audit_store

__all__ = [
    "AuditReport",
    "Finding",
    "audit_store",
]
