"""The active session: its one pointer and lock, initialize/deinitialize and the public API functions."""
