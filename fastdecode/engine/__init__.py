"""The engine: requests in, finished requests out. One step = schedule -> run -> postprocess
(llm_engine), the model run over a batch (runner), sampling (sampler), the request and sequence
records (sampling_params, sequence), token masks and per-step statistics.
"""
