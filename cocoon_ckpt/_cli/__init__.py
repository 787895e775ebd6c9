"""The `cocoon-ckpt` command line: one module per command group. The only part of
cocoon_ckpt allowed to import fault_injection."""
