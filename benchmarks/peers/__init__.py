"""Other KV-cache systems run as peers in our benchmarks, each in its own virtualenv."""
