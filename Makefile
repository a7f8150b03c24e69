# The two commands the README promises; each installs what it needs first.
.PHONY: demo test
ARGS ?=

demo:
	bash scripts/demo.sh $(ARGS)

test:
	bash scripts/test.sh $(ARGS)
