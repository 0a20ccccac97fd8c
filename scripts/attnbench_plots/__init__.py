"""Figures and the markdown report of an attnbench results directory, one module per figure
family so that new families join without growing one file:

  style        colours and markers per variant spec, axes, legend and markdown helpers
  context      the results being drawn, their panels, and the report being written
  quality      what a variant costs a trained model (DIR/quality/ of scripts/quality.py):
               recall accuracy, bits per byte before and after uptraining, speed over flash
               at the same n, recall against decode state and training time
  time_memory  time and peak memory against n, and the efficiency table relative to full
  error        error against n, and speed against error with the Pareto frontier
  budget       error against budget: each approximation over its budget parameter on the
               trained inputs (time, error, mean cosine against the setting; the frontier)
  crossover    time relative to flash and full, and the crossover lengths
  patterns     the attention-pattern gallery from the patterns the sweep stored
  training     the training passes (bwd, fwdbwd): time and memory against n, gradient error
               against forward error, time against gradient error, the training table
  decode       the decode pass: time per token and state per sequence against the context,
               the decode table at the largest context
  anatomy      a trained model's heads (DIR/trained/anatomy.csv of scripts/anatomy.py):
               entropy, window mass, sinks and the mass inside each fixed pattern
  report       report.md: the run header, every section in order, the rows not drawn

Everything is read from the results directory (results.csv, meta.json, patterns/,
trained/, quality/); no attnbench binary is run. scripts/plot.py is the command line.
"""
