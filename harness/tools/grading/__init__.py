"""The grading engine: the checks behind test.py (`checks`, judging by the rules in `policy` what the
rank jobs in `jobs` saw, with `compare` saying what differs), the spawned rank pools (`ranks`: trusted
for FSDP2, sandboxed for the file under test), what a sandboxed rank sends back (`wire`), the user it
runs as (`sandbox`), whether the FSDP is the student's own (`handwritten`) and FSDP2's side of each
check stored per case (`fsdp2_cache`)."""
