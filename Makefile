# Two entry points for a fresh machine; each creates .venv and installs distopt on first use.
#   make train   the main job: a real multi-rank GPT training run on the embedded data
#   make test    the whole test suite (installs the peers it compares with: make peers)
PY      := .venv/bin/python
STAMP   := .venv/.installed
PEERS   := .venv/.peers-installed

.PHONY: setup peers train test

# _version.py: an editable install's metadata holds the version it was installed with.
$(STAMP): pyproject.toml constraints.txt src/distopt/_version.py
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	@# A .venv made before distopt was named torch-distopt has it registered as distopt.
	$(PY) -m pip uninstall -q -y distopt 2>/dev/null || true
	$(PY) -m pip install -q -c constraints.txt -e '.[train,dev,hf,lightning,ft]'
	touch $(STAMP)

setup: $(STAMP)

# Megatron-Core and DeepSpeed, for `distopt bench --systems megatron ... deepspeed-z2` and
# tests/test_peers.py. Megatron-Core 0.19.2 declares Requires-Python >= 3.12 but ships a wheel
# for 3.11 whose core needs only torch, numpy and packaging (from the extra): hence --no-deps.
$(PEERS): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[peers]'
	$(PY) -m pip install -q -c constraints.txt --ignore-requires-python --no-deps megatron-core==0.19.2
	touch $(PEERS)

peers: $(PEERS)

train: $(STAMP)
	.venv/bin/distopt train $(ARGS)

test: $(STAMP) $(PEERS)
	$(PY) -m ruff check .
	$(PY) -m pytest $(ARGS)
