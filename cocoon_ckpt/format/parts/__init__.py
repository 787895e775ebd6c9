"""One codec per part of a trainer's state: `model`, `optimizer`, `rng`, `noise`,
`user` (the scheduler and the job's own stateful parts); the embedding tables are
`format.table_codec`. Each encodes its part to an `Encoded` (record and arrays) and
decodes it from a verified version; `format.codec` only puts them together. A new
piece of checkpointed state is a codec here and its line in the trainer's state."""
