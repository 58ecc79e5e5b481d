"""The engine: slot table, scheduler (the one slot logic), model runner, sync and async drivers."""
