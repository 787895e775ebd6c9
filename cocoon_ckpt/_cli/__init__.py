"""The `cocoon-ckpt` command line: one module per command group, parser next to handler.

- `main`: the entry point; builds the parser from each command's `add_parser` and
  dispatches.
- `exits`: the exit code of each error class (one table) and the one-line message.
- `args`: the parser class and the options and argument types commands share.
- `train` (with `train_config`, the flags as a JobConfig whose defaults are the
  dataclasses', and `progress`, its bars), `export`, `catalog` (inspect, diff, gc),
  `audit`, `chaos`.

`chaos` is the only module of cocoon_ckpt that imports fault_injection.
"""
