"""The release lifecycle: registry, report, promotion, re-benchmarks, alerts and the local target."""
