"""absl apps: pretrain, finetune, evaluate, quickstart, benchmark."""
