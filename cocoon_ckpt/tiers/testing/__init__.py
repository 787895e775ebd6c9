"""Conformance suites shipped with the library, as `state.testing` is for stores:
`history_tests.RingHistoryTests` for every `RingHistory` (the plain host ring and the
tiered history on each tier). Here rather than in `dp.testing` because the tiers are
what it must run on, and `dp` may not import them. Imported by test code only."""

__all__: list[str] = []
