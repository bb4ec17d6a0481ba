"""Batch jobs (`fastdecode generate`): OpenAI batch JSONL in and out (jsonl), the job loop
(generate), resume and the output file (resume, output), signals (interrupt), progress in
tokens (progress), the run report (report) and `fastdecode report` (report_cmd: its text,
report_text, and its figure, report_plot).
"""
