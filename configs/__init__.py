"""ml_collections configs, one `get_config(arg)` file per job or experiment."""
