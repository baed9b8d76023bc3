"""Engine metrics: Prometheus exposition (`prometheus.py`), the periodic log line
(`loggers.py`) and the speculative-decoding counters (`spec_decode.py`). The stat loggers are
callables `(scheduler_stats, iteration_stats)` that AsyncLLM calls once per batch of engine
outputs. Nothing is imported here: the engine core imports the counters without
prometheus_client."""
