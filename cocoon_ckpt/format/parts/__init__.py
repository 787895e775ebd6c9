"""One codec per part of a trainer's state: `model`, `optimizer`, `rng`, `noise`,
`tables` (the embedding tables), `user` (the scheduler and the job's own stateful
parts). Each encodes its part to an `Encoded` (record and arrays) and
decodes it from a verified version; `format.codec` only puts them together. A new
piece of checkpointed state is a codec here and its line in the trainer's state."""
