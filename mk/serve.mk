# Serving targets. Included from the Makefile, which defines VENV, PY, PIP, `setup` and `model`
# (and makes `serve` depend on `model`).
#
#   make serve                  start Triton with the default model (Ctrl-C stops it)
#   make serve SERVE_ARGS="--http-port 9000 -- --log-verbose=1"
#   make perf-deps              install perf_analyzer (for perf/perf_analyzer_sweep.sh, genai-perf)
#   make soak                   the long reliability tests (drain, killed stub, killed launcher)

SERVE_ARGS ?=
PA_DIR := $(VENV)/lib/perf_analyzer
PA_BIN := $(PA_DIR)/perf_analyzer
PA_WRAPPER := $(VENV)/bin/perf_analyzer
# The last tritonclient wheel that ships a perf_analyzer binary which runs on glibc 2.36.
PA_TRITONCLIENT := 2.51.0

.PHONY: serve serve-deps perf-deps

# tritonserver comes from the nvidia-pytriton wheel (the `serve` extra that `setup` installs) or
# from PATH in the NGC container; engine.serve prepares its backends folder. This only checks.
serve-deps: setup
	$(PY) -m engine.serve --check

serve: serve-deps
	$(PY) -m engine.serve $(SERVE_ARGS)

perf-deps: $(PA_WRAPPER)

# perf_analyzer needs libb64.so.0d and libcudart.so.12; the nvidia-pytriton wheel carries both
# (under hashed names), so they are linked next to the binary instead of installed system-wide.
$(PA_WRAPPER): | setup
	rm -rf $(PA_DIR) && mkdir -p $(PA_DIR)/wheel
	$(PIP) download -q --no-deps --only-binary=:all: -d $(PA_DIR)/wheel \
		tritonclient==$(PA_TRITONCLIENT)
	$(PY) -c 'import glob, zipfile; \
		whl = zipfile.ZipFile(glob.glob("$(PA_DIR)/wheel/*.whl")[0]); \
		data = whl.read("tritonclient-$(PA_TRITONCLIENT).data/data/bin/perf_analyzer"); \
		open("$(PA_BIN)", "wb").write(data)'
	chmod +x $(PA_BIN) && rm -rf $(PA_DIR)/wheel
	libs=$$($(PY) -c 'import pathlib, pytriton; \
		print(pathlib.Path(pytriton.__file__).parents[1] / "nvidia_pytriton.libs")') && \
		ln -sf $$(ls $$libs/libb64-*.so.0d | head -1) $(PA_DIR)/libb64.so.0d && \
		ln -sf $$(ls $$libs/libcudart-*.so.12* | head -1) $(PA_DIR)/libcudart.so.12
	printf '#!/bin/sh\nLD_LIBRARY_PATH="%s$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" exec "%s" "$$@"\n' \
		"$(abspath $(PA_DIR))" "$(abspath $(PA_BIN))" > $(PA_WRAPPER)
	chmod +x $(PA_WRAPPER)

# `make soak`: the long reliability runs against the real server (tests marked `soak`: SIGTERM
# with long streams, a killed stub, a killed launcher); `make test` leaves them out.
.PHONY: soak
soak: model
	$(VENV)/bin/pytest -q -s -m soak tests/e2e
