"""The sharded runtime: driver, worker processes and their messages. Uses inference.model, never inference.serving."""
