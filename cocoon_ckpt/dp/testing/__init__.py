"""Conformance suites shipped with the library, as `state.testing` is for stores:
`noise_tests.NoiseMechanismTests` for every `NoiseMechanism`. Imported by test code
only (they need pytest)."""

__all__: list[str] = []
