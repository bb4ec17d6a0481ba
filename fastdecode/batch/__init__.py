"""Batch jobs (`fastdecode generate`): OpenAI batch JSONL in and out (jsonl), the job loop
(generate), resume and the output file (resume, output), which request each row answers
(fingerprint, binding), the files beside the output (sidefiles, filemode, lock, paths), signals
(interrupt) and the generation a stop saves (inflight), progress in tokens (progress), the run
report (report) and `fastdecode report` (report_cmd: its text, report_text, and its figure,
report_plot).
"""
