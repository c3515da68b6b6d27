"""The merging experiments as plain functions of (config, workdir): `merge` (every configured
method over its hyperparameter grid, λ and settings chosen on validation) and `safety` (backdoored
task vectors through every merge). `launch.merge` and `launch.safety` each call one `run`."""
