"""Serving the engine through Triton Inference Server. Nothing here imports torch or Triton.

Launcher side (`python -m engine.serve`, see engine/serve.py):
  install.py     finds `tritonserver`, prepares the backends folder and the server's environment
  process.py     one tritonserver process: start (dies with its parent), readiness, stop, kill
  supervisor.py  keeps it serving: drains on SIGTERM/SIGINT, restarts it when a stub dies
  cli.py         the command line

Model side (imported by model_repository/llm/1/model.py inside the Python-backend stub):
  protocol.py    a request's inputs -> prompt, SamplingParams, options; each delta -> a reply
  lifecycle.py   SIGTERM/SIGINT to the stub -> drain; the stub ends when its server dies
  disconnects.py HTTP clients that left before Triton noticed (non-streaming `/generate`)
"""
