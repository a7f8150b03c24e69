"""The core: the release spec, paths, errors, artifacts on disk and in network storage. Imports nothing above it."""
