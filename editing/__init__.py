"""editmerge.editing: task vectors, models, the offline suite, fine-tuning regimes, training and
evaluation. Nothing here imports `merging` or `launch`."""
