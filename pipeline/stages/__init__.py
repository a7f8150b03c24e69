"""The stages a release passes through: materialize, quantize, evaluate, serve and benchmark. Import only the core."""
