"""Serving the engine through Triton Inference Server. Nothing here imports torch or Triton.

Launcher side (`python -m engine.serve`, see engine/serve.py):
  install.py     finds `tritonserver`, prepares the backends folder and the server's environment
  process.py     one tritonserver process: start, readiness, stop
  cli.py         the command line

Model side (imported by model_repository/llm/1/model.py inside the Python-backend stub):
  requests.py    a Triton request's inputs -> prompt, SamplingParams, output options
"""
