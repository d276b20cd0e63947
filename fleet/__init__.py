"""fleet: the supervisor. Reads fleet.toml, deploys `worker/` over SSH, launches one shard per GPU,
follows them live (TUI or headless) and restarts dead shards. Never imports torch."""

__version__ = "0.1.0"
