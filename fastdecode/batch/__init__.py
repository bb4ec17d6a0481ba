"""Batch jobs (`fastdecode generate`): OpenAI batch JSONL in and out (jsonl), the job loop
(generate), resume and the output file (resume, output), signals (interrupt), progress lines
and the run report (progress, report).
"""
