# make docs: the HTML site from docs/ (pages and API reference), warnings as errors.
# make figures: the accuracy and speed pictures the docs show (docs/_static/*.png).
PYTHON ?= .venv/bin/python

.PHONY: docs figures

docs:
	$(PYTHON) -m sphinx -W --keep-going -b html docs docs/_build/html

figures:
	$(PYTHON) -m detsum figures --out docs/_static
