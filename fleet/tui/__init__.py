"""The live Textual view of a run (fed by fleet.supervisor snapshots)."""
