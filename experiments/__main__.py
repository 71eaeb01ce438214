from experiments.quality import main

main()
