"""Tiers: where every weight lives (GPU, RAM, SSD) and how experts move between them.

sizes       byte sizes as typed (23.44G, 512M, 30%)
options     the tier options shared by `strata run`, `strata plan` and `strata.load`
hardware    the device tier (CUDA, or CPU memory standing in) and RAM budgets
plan        a home tier for every tensor and the expert cache's slot count
plan_cli    `strata plan`
store       experts' homes: RAM (loaded once) or disk (pread on demand into a RAM cache)
device_cache  fixed slots of one expert each, a copy stream, regions under policies
policy      replacement and admission: adaptive (a learned reuse estimate), lru, lfu, static
executor    hits on the device, misses on a CPU pool, at once; the backend `Experts` calls
prefetch    the next layer's router on the current hidden state names experts to copy in
placement   non-expert blocks on CUDA (--gpu-layers)
trace       routing decisions recorded and written once (.npz)
cache_sim   `strata cache-sim`: replay a trace under policies beside Belady's MIN
runtime     `install(loaded, options)`: all of the above wired into a loaded model
"""
