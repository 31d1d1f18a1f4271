"""Starting llama-server and kvproxy processes: ``make run``, the tests, the benchmark."""
