"""The planner: predicts each layout's max SLO rate before any GPU time is spent.

`step_time` models one engine step from the model's shape and the device's datasheet,
`simulate` runs vLLM's continuous batching on that model under the workload's arrivals, and
`plan` ranks every feasible layout by its predicted max rate per server.
"""
