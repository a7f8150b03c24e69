# The two commands the README promises; each installs what it needs first. `make docs` builds the
# docs site (regenerating its references from the code and the measurements first).
.PHONY: demo test docs
ARGS ?=

demo:
	bash scripts/demo.sh $(ARGS)

test:
	bash scripts/test.sh $(ARGS)

docs:
	bash scripts/docs.sh $(ARGS)
