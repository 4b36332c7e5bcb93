"""The batch runner: RQ jobs that expand a batch's input file into requests on the batch stream,
collect the answers and write the output files."""
