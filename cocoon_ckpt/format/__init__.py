"""The version format: how a trainer's state becomes a version's arrays and records and
is read back, and how the tools read a committed version (records, model, ring rows,
metrics, the fingerprint). Below `train` and `tools`, above `embedding`, `tiers`, `dp`;
trainer-free and, for the records and metrics, torch-free at import."""
