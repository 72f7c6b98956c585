"""One module per primitive: operator registration, fake kernel, autograd, public function."""
