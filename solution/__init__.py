"""For instructors: the reference FSDP, the skeleton generator, the release command and their tests."""
