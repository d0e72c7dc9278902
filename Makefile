# Two entry points for a fresh machine; each creates .venv and installs distopt on first use.
#   make train   the main job: a real multi-rank GPT training run on the embedded data
#   make test    the whole test suite
PY      := .venv/bin/python
STAMP   := .venv/.installed

.PHONY: setup train test

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[train,dev,hf,lightning]'
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	.venv/bin/distopt train $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(ARGS)
