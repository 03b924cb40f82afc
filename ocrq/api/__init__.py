"""Producers' side: enqueue jobs and read their status. Never imports torch or the engines."""
