"""`kvscope bench` / `python -m app.bench`: the benchmark front-end. It writes workloads, spawns
the engine-side workers (engine_proc/bench/) and the HTTP/ZeroMQ clients, and prints the tables
of ratios against a baseline from the same run."""
