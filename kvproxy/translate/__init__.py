"""Pure translations between client wire formats and llama-server's bodies."""
