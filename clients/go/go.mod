module sfcore.local/sfcore

go 1.19
