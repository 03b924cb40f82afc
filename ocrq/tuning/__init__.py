"""`ocrq tune`: probing an engine's memory, fitting its cost model, writing profiles (which
workers read at start-up)."""
