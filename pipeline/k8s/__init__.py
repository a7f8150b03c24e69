"""The Kubernetes side of a release: `manifests` renders a chosen layout as objects, `deploy` rolls
them out with the official client (server-side apply, rollout wait, smoke test, rollback)."""
