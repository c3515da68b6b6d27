"""absl mains, one per job: each parses flags and makes one library call (`editing.jobs`,
`merging.jobs`). Nothing here is imported by the library or by another main."""
