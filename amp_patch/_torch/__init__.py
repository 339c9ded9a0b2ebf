"""Every read of torch internals (version checks, private names, dynamo's tables): one place to adapt per release."""
