"""Submissions: the points table (`points`), a folder of submissions graded to CSV (`grade`), what a
student attaches (`handin`), what Gradescope runs per submission (`gradescope`), their code compared
with FSDP2's and with each other (`similarity`), and their text shown as text (`inert`)."""
