"""The ground floor: settings, the wire contract, the job table and its store. Imports nothing
of ocrq above it."""
